"""weight_sync: versioned policy weights from the trainer to the serving fleet.

The trainer publishes each version as a keyframe (full tensors) or a delta
against its parent; the server stores the blob, records the manifest in the Redis
registry and streams the shortest path to each subscribing inference worker.
"""
