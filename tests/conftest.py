from tests.fixtures_s3 import *  # noqa
from tests.fixtures_targets import *  # noqa
