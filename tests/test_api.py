import types

import devipc


def test_every_public_name_is_exported_once():
    assert len(devipc.__all__) == len(set(devipc.__all__))
    for name in devipc.__all__:
        assert hasattr(devipc, name), name
    public = {name for name, value in vars(devipc).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert public == set(devipc.__all__)
