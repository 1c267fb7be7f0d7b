"""The command line: `kvfs` and `mount.kvfs` (`main`), `kvfs stat` (`statview`), `kvfs prewarm`
(`prewarm`), `kvfs fsck` (`fsck`)."""
