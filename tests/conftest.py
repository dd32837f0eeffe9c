from tests.fixtures_s3 import *  # noqa
