"""``mpizero.testing.first_difference``: raw bytes, not values, decide equality; the message names the spot."""

import numpy as np

from mpizero.testing import first_difference


def test_equal_bytes_give_none_even_for_nan():
    a = {"w": np.array([1.5, np.nan], np.float32)}
    assert first_difference(a, {"w": a["w"].copy()}) is None


def test_negative_zero_differs_from_zero():
    message = first_difference({"w": np.float32([0.0, -0.0])}, {"w": np.float32([0.0, 0.0])})
    assert message == "'w'[1]: -0.0 (0x80000000) != reference 0.0 (0x00000000) (1 of 2 elements differ)"


def test_index_is_given_in_the_tensor_shape():
    got = np.zeros((3, 4), np.float32)
    got[2, 1] = got[2, 3] = np.float32(1e-30)
    message = first_difference({"a": np.zeros(2, np.float32), "m": got}, {"a": np.zeros(2, np.float32), "m": 0 * got})
    assert message.startswith("'m'[2, 1]: ") and message.endswith("(2 of 12 elements differ)")


def test_names_shapes_and_dtypes_are_checked_first():
    w = np.zeros(3, np.float32)
    assert "tensor names differ" in first_difference({"w": w}, {"v": w})
    assert first_difference({"w": w}, {"w": np.zeros(4, np.float32)}) == "'w' is float32[3], reference float32[4]"
    assert first_difference({"w": w}, {"w": w.astype(np.float64)}) == "'w' is float32[3], reference float64[3]"
