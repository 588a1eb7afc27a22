import numpy as np
import pytest

from kvserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ],
)
def test_bad_values_raise_with_parameter_name(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**kwargs)
    value = next(v for k, v in kwargs.items() if k == name)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        # Sequence i is seeded seed + i, which must fit torch's seed range too.
        ({"seed": 2**64 - 1, "n": 2}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e308}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": 1e39}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": {"5": float("inf")}}, r"logit_bias\[5\]=inf"),
        ({"logit_bias": {"5": float("nan")}}, r"logit_bias\[5\]=nan"),
        ({"logit_bias": {"5": 1e308}}, r"logit_bias\[5\]=1e\+308"),
    ],
)
def test_values_the_sampler_cannot_represent_raise(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_extreme_representable_values_accepted() -> None:
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=2**64 - 3, n=3)
    SamplingParams(seed=-(2**63), n=4)
    SamplingParams(top_k=2**63 - 1, temperature=3e38, repetition_penalty=3e38,
                   logit_bias={"1": -3e38})


def test_unknown_stop_type_message() -> None:
    with pytest.raises(ValueError, match="unknown stop type"):
        SamplingParams(stop=["a", 1])


def test_range_mentioned() -> None:
    with pytest.raises(ValueError, match=r"0 < top_p <= 1"):
        SamplingParams(top_p=2.0)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, -1, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.is_greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(logit_bias={"7": -100}).logit_bias == {7: -100.0}
    assert SamplingParams(max_tokens=None, min_tokens=50).max_tokens is None


def test_boundary_values_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=2.0,
                   frequency_penalty=-2.0, repetition_penalty=0.5, logprobs=0,
                   prompt_logprobs=0, min_tokens=16, max_tokens=16)


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_verify_token_ids() -> None:
    SamplingParams(logit_bias={0: 1.0, 9: 1.0}, stop_token_ids=[0, 9]).verify_token_ids(10)
    with pytest.raises(ValueError, match=r"logit_bias.*\[0, 10\)"):
        SamplingParams(logit_bias={10: 1.0}).verify_token_ids(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0}).verify_token_ids(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[3, 12]).verify_token_ids(10)


# Each of these used to pass validation and then raise inside the engine's step (range() of a
# float n, manual_seed of a float, topk() of a float count), failing every request batched
# with it; now it is refused when the parameters are built.
@pytest.mark.parametrize(
    ("kwargs", "name", "kind"),
    [
        ({"n": 2.5}, "n", "an integer"),
        ({"seed": 1.5}, "seed", "an integer"),
        ({"logprobs": 1.5}, "logprobs", "an integer"),
        ({"prompt_logprobs": 0.5}, "prompt_logprobs", "an integer"),
        ({"top_k": "3"}, "top_k", "an integer"),
        ({"max_tokens": float("inf")}, "max_tokens", "an integer"),
        ({"min_tokens": float("nan")}, "min_tokens", "an integer"),
        ({"n": True}, "n", "an integer"),
        ({"temperature": "0.5"}, "temperature", "a number"),
        ({"top_p": None}, "top_p", "a number"),
        ({"repetition_penalty": False}, "repetition_penalty", "a number"),
    ],
)
def test_values_of_the_wrong_type_raise(kwargs: dict, name: str, kind: str) -> None:
    value = kwargs[name]
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == f"{name} must be {kind}, got {name}={value!r}"


def test_whole_numbers_of_other_types_become_ints_and_floats() -> None:
    params = SamplingParams(n=np.int64(2), seed=np.uint64(7), max_tokens=8.0, top_k=40.0,
                            temperature=1, top_p=np.float32(0.5))
    assert (params.n, params.seed, params.max_tokens, params.top_k) == (2, 7, 8, 40)
    assert all(type(v) is int for v in (params.n, params.seed, params.max_tokens, params.top_k))
    assert (params.temperature, params.top_p) == (1.0, 0.5)
    assert type(params.temperature) is float and type(params.top_p) is float
