"""An agent app deployed in two versions at once, for the rolling-deploy test
(tests/runs/test_rolling_deploy.py): ``ROLLING_VERSION`` (1 or 2) says which code this
process runs, as two releases of one app would on old and new workers."""
