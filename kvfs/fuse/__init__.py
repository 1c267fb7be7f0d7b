"""The FUSE layer's support: the binding kvfs runs on (`binding`), the notifier that pushes
cache invalidations to the kernel (`notifier`)."""
