"""collector.paused: no cyclic collection in the block, the collector as it was after it."""

import gc

import pytest

from torchfarm.client import collector


@pytest.fixture
def collecting():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_collector_is_off_in_the_block_and_on_after_it_even_on_an_error(collecting):
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector.paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off(collecting):
    gc.disable()
    with collector.paused():
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_nested_blocks_turn_it_on_only_at_the_outermost_end(collecting):
    with collector.paused():
        with collector.paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
