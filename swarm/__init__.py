"""hivepipe's library: compression, models and data, the engine and its two transports, training,
the lab, benchmarks and studies (README.md, "Layout")."""

__version__ = "0.1.0"

import warnings

# hivemind still calls torch.jit.script at import; its deprecation notice is not ours to act on
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
