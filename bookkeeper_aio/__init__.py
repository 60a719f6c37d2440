"""bookkeeper-aio: asyncio-native BookKeeper client."""
