"""devipc._tools._bench.weight_sync's plot: its bars say what a user would write, not the
modes' names."""

from devipc._tools._bench import weight_sync


def test_the_plot_labels_each_mode_in_user_words():
    measured = {"nbytes": 1 << 20, "results": {mode: (0.2, 0.1, 1) for mode in weight_sync.MODES}}
    panel = weight_sync.panel(measured)
    assert panel.x == [
        "torch CPU shared, per tensor",
        "devipc, per tensor",
        "share_state_dict (copy)",
        "pack + share_state_dict",
        "Arena, 2 buffers",
        "Arena, 1 buffer",
        "copy through CPU",
    ]
    assert panel.series == {"first sync": [0.2] * 7, "later syncs (median)": [0.1] * 7}
