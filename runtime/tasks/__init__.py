"""The task registry: every endpoint the service answers, by path.

A task is one module with a `Task` subclass (runtime/tasks/common.py): its request schema,
`prepare` (tokenise, windows) and `finish` (decode). The HTTP routes, the fast path, the
handler and evaluation are generated from or driven by this table; nothing else names a task.
"""

from __future__ import annotations

from bertserve.runtime.tasks import (
    classify,
    cohere_embed,
    embed,
    encode,
    fill_mask,
    multivector,
    ner,
    nsp,
    qa,
    rerank,
    sparse,
    tokens,
)
from bertserve.runtime.tasks.common import Task

TASKS: dict[str, Task] = {
    t.path: t
    for t in (
        fill_mask.TASK,
        classify.TASK,
        ner.TASK,
        qa.TASK,
        nsp.TASK,
        embed.EMBED,
        embed.EMBED_CHUNKS,
        embed.OPENAI_EMBEDDINGS,
        embed.SIMILARITY,
        rerank.RERANK,
        rerank.COHERE_RERANK,
        rerank.COHERE_RERANK_V2,
        sparse.EMBED_SPARSE,
        tokens.EMBED_ALL,
        multivector.MULTI_VECTOR,
        encode.ENCODE,
        cohere_embed.COHERE_EMBED,
    )
}
# The capabilities (bundle.json "tasks", runtime/capabilities.py) some endpoint serves,
# and the outputs the endpoints read of each.
READS: dict[str, set[str]] = {}
for _task in TASKS.values():
    READS.setdefault(_task.capability, set()).update(_task.reads)

__all__ = ["READS", "TASKS", "Task"]
