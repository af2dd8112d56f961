"""One link's flow: pacing what is sent, metering what arrives, busy time, and the order of a link's messages."""
