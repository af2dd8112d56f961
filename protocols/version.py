"""The one version of what hivepipe peers say to each other: the stage protocol (stage.proto), the
tensor format (compressed_tensor.proto) and the stream they travel on. Bumped whenever any of them
changes; a peer refuses requests, records and payloads of another version in one line."""

PROTOCOL_VERSION = 12
STREAM = f"hivepipe.stage/{PROTOCOL_VERSION}"  # the libp2p protocol of every stage call
