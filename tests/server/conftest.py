"""tests/server: the residency policy (test_room.py) runs on a real residency core, on lavapipe
unless VRAMD_TEST_DEVICE=native: the engine tests' device (importing it chooses the driver)."""

from tests.engine.conftest import device  # noqa: F401
