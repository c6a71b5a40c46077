"""SamplingParams validation: every invalid value of every field is a ValueError naming it."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm import InvalidRequestError, SamplingParams

NOT_NUMBERS = st.one_of(st.text(max_size=3), st.none(), st.booleans(), st.lists(st.integers()))
NOT_INTS = st.one_of(NOT_NUMBERS, st.floats(allow_nan=True))
NOT_BOOLS = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.floats())
NAN_INF = st.sampled_from([math.nan, math.inf, -math.inf])


def _outside(lo: float, hi: float, lo_open: bool = False) -> st.SearchStrategy[object]:
    below = st.floats(max_value=lo, exclude_max=not lo_open, allow_nan=False)
    above = st.floats(min_value=hi, exclude_min=True, allow_nan=False)
    return st.one_of(below, above, NAN_INF, NOT_NUMBERS)


INVALID: dict[str, st.SearchStrategy[object]] = {
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=257), NOT_INTS),
    "max_tokens": st.one_of(st.integers(max_value=0), NOT_INTS.filter(lambda v: v is not None)),
    "min_tokens": st.one_of(st.integers(max_value=-1), st.integers(min_value=17), NOT_INTS),
    "temperature": _outside(0.0, 100.0),
    "top_p": _outside(0.0, 1.0, lo_open=True),
    "top_k": st.one_of(st.integers(max_value=-2), st.integers(min_value=2**31), NOT_INTS),
    "min_p": _outside(0.0, 1.0),
    "presence_penalty": _outside(-2.0, 2.0),
    "frequency_penalty": _outside(-2.0, 2.0),
    "repetition_penalty": _outside(0.0, 100.0, lo_open=True),
    "seed": st.one_of(
        st.integers(max_value=-(2**63) - 1),
        st.integers(min_value=2**64),
        NOT_INTS.filter(lambda v: v is not None),
    ),
    "stop": st.one_of(
        st.integers(),
        st.dictionaries(st.text(), st.text(), min_size=1),
        st.lists(st.one_of(st.integers(), st.none(), st.just("")), min_size=1),
        st.lists(st.text(min_size=1), max_size=3).map(lambda xs: [*xs, ""]),
        st.lists(st.text(min_size=1), min_size=65, max_size=80),  # over MAX_STOP_STRINGS
    ),
    "stop_token_ids": st.one_of(
        st.integers(),
        st.text(min_size=1),
        st.lists(st.integers(max_value=-1), min_size=1),
        st.lists(st.one_of(st.floats(), st.none(), st.booleans()), min_size=1),
    ),
    "include_stop_str_in_output": NOT_BOOLS,
    "ignore_eos": NOT_BOOLS,
    "skip_special_tokens": NOT_BOOLS,
    "logprobs": st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=21),
        NOT_INTS.filter(lambda v: v is not None),
    ),
    "prompt_logprobs": st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=21),
        NOT_INTS.filter(lambda v: v is not None),
    ),
    "logit_bias": st.one_of(
        st.integers(),
        st.lists(st.integers(), min_size=1),
        st.dictionaries(st.integers(max_value=-1), st.floats(-100, 100), min_size=1),
        st.dictionaries(
            st.text(min_size=1).filter(lambda s: not (s.isascii() and s.isdigit())),
            st.floats(-100, 100),
            min_size=1,
        ),
        st.dictionaries(st.integers(0, 10**6), _outside(-100.0, 100.0), min_size=1),
    ),
    "output_kind": st.one_of(
        st.text().filter(lambda s: s not in ("delta", "cumulative", "final")), st.integers()
    ),
    "structured_outputs": st.one_of(
        st.integers(),
        st.text(),
        st.just({}),  # none of the kinds
        st.just({"regex": "a", "choice": ["a"]}),  # two kinds
        st.just({"json_object": False}),  # False is "not set"
        st.fixed_dictionaries({"regex": st.one_of(st.integers(), st.just(""))}),
        st.fixed_dictionaries({"grammar": st.one_of(st.integers(), st.just(""))}),
        st.fixed_dictionaries({"json": st.one_of(st.integers(), st.lists(st.integers()))}),
        st.fixed_dictionaries({"json": st.sampled_from(["{", '{"type":', "[1]", "nope"])}),
        st.fixed_dictionaries(
            {"choice": st.one_of(st.just([]), st.text(), st.lists(st.integers(), min_size=1))}
        ),
        st.fixed_dictionaries({"json_object": st.one_of(st.integers(), st.text(min_size=1))}),
        st.fixed_dictionaries({"json_object": st.just(True), "disable_any_whitespace": NOT_BOOLS}),
        st.fixed_dictionaries({"regex": st.just("a"), "unknown_field": st.integers()}),
    ),
}

VALID_STRUCTURED = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"json": st.just({"type": "object", "properties": {"a": {"type": "integer"}}})}
    ),
    st.fixed_dictionaries({"json": st.just('{"type": "string"}')}),
    st.fixed_dictionaries({"json_object": st.just(True)}),
    st.fixed_dictionaries({"regex": st.text(min_size=1)}),
    st.fixed_dictionaries({"choice": st.lists(st.text(), min_size=1)}),
    st.fixed_dictionaries(
        {"grammar": st.text(min_size=1)}, optional={"disable_any_whitespace": st.booleans()}
    ),
)


def test_every_field_has_an_invalid_strategy():
    fields = set(SamplingParams.__struct_fields__)
    assert fields == set(INVALID), fields ^ set(INVALID)


@pytest.mark.parametrize("field", sorted(INVALID))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_invalid_value_names_the_field(field, data):
    value = data.draw(INVALID[field], label=field)
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, InvalidRequestError)


VALID = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 256),
        "max_tokens": st.one_of(st.none(), st.integers(16, 10**6)),
        "min_tokens": st.integers(0, 16),
        "temperature": st.floats(0, 100),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(-1, 10**6),
        "min_p": st.floats(0, 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 100, exclude_min=True),
        "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
        "stop": st.one_of(
            st.none(), st.text(min_size=1), st.lists(st.text(min_size=1), max_size=64)
        ),
        "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 10**6))),
        "include_stop_str_in_output": st.booleans(),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "logit_bias": st.one_of(
            st.none(), st.dictionaries(st.integers(0, 10**6), st.floats(-100, 100))
        ),
        "skip_special_tokens": st.booleans(),
        "output_kind": st.sampled_from(["delta", "cumulative", "final"]),
        "structured_outputs": VALID_STRUCTURED,
    },
)


@settings(max_examples=200, deadline=None)
@given(VALID)
def test_valid_values_construct_and_round_trip_through_json(kwargs):
    params = SamplingParams(**kwargs)
    assert isinstance(params.stop, list) and isinstance(params.stop_token_ids, list)
    assert params.top_k >= 0
    again = msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams)
    assert again == params


def test_json_decoding_validates_too():
    with pytest.raises(ValueError, match="temperature"):
        msgspec.json.decode(b'{"temperature": -1}', type=SamplingParams)
    with pytest.raises(ValueError, match="logit_bias"):
        msgspec.json.decode(b'{"logit_bias": {"5": 500}}', type=SamplingParams)
    params = msgspec.json.decode(b'{"logit_bias": {"5": -100}, "stop": "x"}', type=SamplingParams)
    assert params.logit_bias == {5: -100.0} and params.stop == ["x"]


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logit_bias={"42": 1}).logit_bias == {42: 1.0}
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(min_tokens=3, max_tokens=3).min_tokens == 3
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=4, max_tokens=3)


def test_stop_strings_are_capped():
    """Every stop string is searched for in each text delta on the event loop: a request
    may give at most MAX_STOP_STRINGS of them (a list or a tuple)."""
    from asyncllm.sampling_params import MAX_STOP_STRINGS

    assert MAX_STOP_STRINGS == 64
    assert len(SamplingParams(stop=[f"s{i}" for i in range(64)]).stop) == 64
    for stop in ([f"s{i}" for i in range(65)], ("x",) * 350_000):
        with pytest.raises(InvalidRequestError, match=r"^stop holds \d+ strings; at most 64"):
            SamplingParams(stop=stop)
