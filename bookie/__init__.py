"""The bookie: the storage server of bookkeeper-aio."""
