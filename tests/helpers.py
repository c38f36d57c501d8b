"""State dicts used across tests."""

import torch


def sample_state_dict(seed: int = 0, scale: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(64 * scale, 32, generator=g),
            "linear.weight": torch.randn(32, 32, generator=g, dtype=torch.float64),
            "linear.bias": torch.randn(32, generator=g).to(torch.bfloat16),
            "counts": torch.randint(0, 100, (17,), generator=g),
        },
        "optim": {"step": 1000 + seed, "lr": 0.1, "betas": [0.9, 0.999]},
        "extra": b"opaque-bytes",
    }


def zeros_like_state_dict(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = zeros_like_state_dict(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = type(v)() if not isinstance(v, (int, float)) else 0 * v
    return out


def assert_state_dict_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_state_dict_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


class Epoch:
    """A plain user type: weights-only unpickling refuses it until it is allowed."""

    def __init__(self, n: int):
        self.n = n

    def __eq__(self, other) -> bool:
        return isinstance(other, Epoch) and other.n == self.n

    def __repr__(self) -> str:
        return f"Epoch({self.n})"
