"""Row locks of the scheduler, always taken in one order (node, then accelerator) so two
callers never deadlock. Call inside ``transaction.atomic()``."""

from __future__ import annotations

from scheduler.models import Accelerator, Node


def lock_budget(node: Node, accelerator: Accelerator | None = None) -> tuple[Node, Accelerator | None]:
    """Lock the node (and accelerator) whose memory is about to be claimed, and reread them."""
    locked_node = Node.objects.select_for_update().get(pk=node.pk)
    locked_accelerator = None
    if accelerator is not None:
        locked_accelerator = Accelerator.objects.select_for_update().get(pk=accelerator.pk, node=locked_node)
    return locked_node, locked_accelerator
