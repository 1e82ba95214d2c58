"""Exceptions a caller of the engine can catch by name."""


class EngineError(RuntimeError):
    """Base class of the engine's own errors."""


class EngineShutdownError(EngineError):
    """The engine was shut down: in-flight requests end with this, new ones are refused."""


class EngineOverloadedError(EngineError):
    """More requests are waiting than `max_waiting_requests` allows; retry later."""


class RequestFailedError(EngineError):
    """The engine failed this request (e.g. a step ran out of memory); others go on."""
