"""The test suite, a package so that its tests import their shared code as `tests.helpers.<module>`
(pytest's default import mode then puts the repository root on sys.path, through this folder's
conftest.py). The test folders under it are not packages: pytest imports each test module by its
file name, which is why no two test files share one."""
