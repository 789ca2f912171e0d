"""A request's state between engines, as the layers above the engine see it: the cache's format
(v4jax.cache.transfer) re-exported, so that the server moves states without reaching into the cache."""
from v4jax.cache.transfer import (POOLS, RequestState, TransferError, check_format, checksum, from_bytes,  # noqa: F401
                                  jax_struct, specs_to_dtypes, to_bytes, verify)
