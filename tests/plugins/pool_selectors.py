"""A data selector for tests (``buffer.selector``), loaded by import path in the trainer's own process."""


def by_group_id(pool, count):
    """The groups whose ids sort first: which group a step takes follows from the ids alone, never from the order
    the trainer happened to read the partitions of buffer.groups."""
    return sorted(pool, key=lambda g: g.group_id)[:count]
