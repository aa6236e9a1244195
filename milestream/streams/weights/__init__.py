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
from milestream.streams.weights.base import (NO_BASE, WeightReceiver, WeightSender, WeightVerificationError,
                                             acknowledge, checksum, checksums, make_receiver, make_sender,
                                             weights_dir)
from milestream.streams.weights.disk import load_version, publish_version

__all__ = ["NO_BASE", "WeightReceiver", "WeightSender", "WeightVerificationError", "acknowledge", "check_applied",
           "check_version", "checksum", "checksums", "load_version", "make_receiver", "make_sender", "publish_version",
           "version_check", "weights_dir"]
