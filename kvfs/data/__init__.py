"""The data path: the volume's layout and lock (`volume`), immutable blobs and staged writes
(`store`, `staged`), the process that changes the volume's namespace off the loop
(`volume_helper`), checksummed reads (`verify`, `cache`) and page-cache residency
(`residency`)."""
