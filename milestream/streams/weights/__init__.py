"""Weight versions as events: the transport interface (base.py) and its transports.

    disk        a full safetensors file per version (disk.py)
    disk-delta  only the bytes that changed since the base version, zstd, with full versions
                every weights.full_every (delta.py)
    broadcast   a torch.distributed group spanning the trainer's sender and the engines
    p2p         each trainer rank writes the shards each engine rank needs
verify.py holds the start-up noise check and the consumer that audits weights.applied
(``weights.verify`` is that module; the checksum check of a delivery is ``base.verify``).
"""
from milestream.streams.versions import check_applied, check_version, version_check
from milestream.streams.weights.base import (NO_BASE, VersionPruned, WeightReceiver, WeightSender,
                                             WeightVerificationError,
                                             acknowledge, checksum, checksums, make_receiver, make_sender,
                                             weights_dir)


def __getattr__(name: str):
    """disk.py's functions, imported when first asked for: disk.py brings torch and safetensors, which the
    verifier and the processor, reading versions, do without."""
    if name in ("load_version", "publish_version"):
        from milestream.streams.weights import disk

        return getattr(disk, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NO_BASE", "VersionPruned", "WeightReceiver", "WeightSender", "WeightVerificationError", "acknowledge", "check_applied",
           "check_version", "checksum", "checksums", "load_version", "make_receiver", "make_sender", "publish_version",
           "version_check", "weights_dir"]
