"""The XLA baseline backend of Pallas-Flash (backend name ``xla``)."""

from pallas_flash_xla.backend import XlaBackend

__all__ = ["XlaBackend"]
