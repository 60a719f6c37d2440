"""Metadata: ledger metadata, bookie registration and id generation on a versioned CAS store."""
