"""The pure scheduling core: no asyncio, grpc, redis, clock or environment. `now` is an argument."""
