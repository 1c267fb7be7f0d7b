"""The FUSE layer: the request handlers (`operations`), the `.kvfs/` control files (`control`),
invalidations pushed to the kernel (`notifier`), the mount's kernel tuning (`tuning`) and
mountinfo (`mounts`), and the one probe of the binding kvfs runs on (`binding`)."""
