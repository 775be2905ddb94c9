"""The test suite's settings: Berth's own, with a cheap password hasher first.

Every persona and administrator a test makes has a password, and Argon2 costs ~100 MiB and tens of
milliseconds a hash by design: the suite would spend most of its time hashing. MD5 hashes new
passwords here; Argon2 stays in the list so a stored Argon2 hash still verifies. The tests that are
about Argon2 (what ``bootstrap`` stores, the bounded hashing slots of the login) put it first again
with the ``argon2_hashing`` fixture (tests/conftest.py).

Processes the tests start (the gateway, the agent, ``serve``) inherit ``DJANGO_SETTINGS_MODULE``
from pytest-django and so read this module too; ``berth.asgi`` and ``manage.py`` only set it when
it is unset.
"""

from berth.settings import *  # every setting, then the test's overrides
from berth.settings import PASSWORD_HASHERS as BERTH_PASSWORD_HASHERS

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher",
                    *(hasher for hasher in BERTH_PASSWORD_HASHERS if "MD5" not in hasher)]
