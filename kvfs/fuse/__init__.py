"""The FUSE layer's support: the binding kvfs runs on (`binding`)."""
