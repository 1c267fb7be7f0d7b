"""Metadata engines: the interface the metadata store writes through (`interface`), the embedded
LMDB engine (`lmdb_engine`, its environment `lmdb_env`, its change log `changelog`) and the
Redis engine of shared pools (`redis_engine`, the loop's own connection `redis_loop`)."""
