import pytest

from app.labs.prefix import PrefixLab, PrefixLimits
from app.settings import Settings


@pytest.fixture
def prefix_lab() -> PrefixLab:
    """One browser's prefix lab under the default settings' limits (a lab is handed its limits: it reads no
    settings of its own)."""
    return PrefixLab(PrefixLimits.of(Settings()))
