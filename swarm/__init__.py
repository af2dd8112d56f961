"""hivepipe's library: compression, stages, data, the pipeline engine, the lab, reports."""

__version__ = "0.1.0"
