"""The trainer side of hotswap: objects a training loop uses to hand checkpoints to the daemon.

Each way in lives in its own module. The file ways (`push`, `publish_s3`) are re-exported here;
the broadcast (`daemon.client.broadcast.BroadcastPush`) needs torch.distributed and is imported
from its own module, so `hotswap publish` and `hotswap push` never load torch.
"""

from typing import TYPE_CHECKING

from daemon import public_face
from daemon.client.publish import PushError, publish_delta, publish_s3, push  # noqa: F401

if TYPE_CHECKING:
    from daemon.client.publish import parse_s3_url

__all__ = ["PushError", "parse_s3_url", "publish_delta", "publish_s3", "push"]

__getattr__ = public_face(__name__)
