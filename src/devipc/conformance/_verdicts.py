"""A check's verdicts: it fails (`CheckFailed`, or `expect` of a condition) or skips (`Skip`);
a leaf, so that the kit, its peers and its checks can all raise them."""


class Skip(Exception):
    """The device does not offer what the check tests; the message says why."""


class CheckFailed(Exception):
    """The device broke the contract; the message says how."""


def expect(condition: object, message: str) -> None:
    """`assert` that survives `python -O`: the kit's verdicts must not depend on a flag."""
    if not condition:
        raise CheckFailed(message)
