"""Property: whatever document a user writes, the params loader either returns valid Params or raises an
InputError whose message is one line; never another exception type, never a multi-line message."""
from __future__ import annotations

import inspect
import types
from typing import Literal, Union, get_args, get_origin

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from hybridcore.errors import InputError
from stages.params import Params, load_params, parse_sets

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

KEYS = st.one_of(st.text(max_size=12), st.integers(-3, 3), st.booleans(), st.none())
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=16))
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(KEYS, inner, max_size=3)), max_leaves=8)


def _plausible(annotation) -> st.SearchStrategy:
    """Values of roughly the right kind for one field: often valid, often just out of range."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):
        return st.one_of(*[_plausible(a) for a in args])
    if origin is list:
        return st.lists(_plausible(args[0]), max_size=5)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), SCALARS, max_size=3)
    if annotation is type(None):
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(-4, 300)
    if annotation is float:
        return st.one_of(st.floats(-1, 2), st.sampled_from([0.0, 1.0, float("inf"), float("nan")]))
    if annotation is str:
        return st.text(max_size=12)
    return JUNK


def section(model: type[BaseModel]) -> st.SearchStrategy:
    """A dict shaped like `model`: some of its real keys with plausible or junk values, plus junk keys."""
    fields = {}
    for name, f in model.model_fields.items():
        ann = f.annotation
        nested = inspect.isclass(ann) and issubclass(ann, BaseModel)
        value = section(ann) if nested else _plausible(ann)
        fields[name] = st.one_of(value, value, value, JUNK)  # mostly the right shape
    real = st.fixed_dictionaries({}, optional=fields)
    extra = st.dictionaries(KEYS, JUNK, max_size=1)
    return st.builds(lambda r, e, keep_junk: {**r, **e} if keep_junk else r, real, extra,
                     st.integers(0, 5).map(lambda n: n == 0))


DOCS = st.one_of(section(Params), section(Params), JUNK)


def _assert_one_line_or_params(load) -> None:
    try:
        p = load()
    except InputError as e:
        msg = str(e)
        assert msg.strip(), "empty InputError message"
        assert len(msg.splitlines()) == 1, repr(msg)
        return
    assert isinstance(p, Params)
    assert Params.model_validate(p.model_dump()) == p  # what the flow hands its tasks validates again


@SETTINGS
@given(doc=DOCS)
def test_any_params_file_loads_or_is_one_line_input_error(doc, tmp_path_factory):
    """A random YAML document as a params file: Params, or an InputError of one line."""
    f = tmp_path_factory.mktemp("doc") / "params.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), encoding="utf-8")
    _assert_one_line_or_params(lambda: load_params(str(f)))


@SETTINGS
@given(doc=section(Params))
def test_any_overrides_load_or_are_one_line_input_error(doc):
    """The same documents as overrides merged onto params/test.yaml: Params, or an InputError of one line."""
    _assert_one_line_or_params(lambda: load_params("test", doc))


SET_KEYS = st.lists(st.sampled_from(["ppo", "sft", "kl_coef", "batch_size", "pipeline", "stages", "x", ""]),
                    min_size=1, max_size=3).map(".".join)


@SETTINGS
@given(items=st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", SET_KEYS, st.text(max_size=10)),
                                st.text(max_size=12)), max_size=3))
def test_any_set_items_load_or_are_one_line_input_error(items):
    """Random --set items (keys, values, no '=' at all) go through parse_sets and load_params the same way."""
    _assert_one_line_or_params(lambda: load_params("test", parse_sets(items)))


def test_strategy_reaches_both_outcomes():
    """The generated documents include some that load and some that are refused (the property is not vacuous)."""
    outcomes = set()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None)
    @given(doc=section(Params))
    def probe(doc):
        try:
            load_params("test", doc)
            outcomes.add("loaded")
        except InputError:
            outcomes.add("refused")

    probe()
    assert outcomes == {"loaded", "refused"}

