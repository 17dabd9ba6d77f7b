"""decode-worker: the decode side of prefill/decode disaggregated serving.

Importing the package has no side effects and pulls in no heavy dependency.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
