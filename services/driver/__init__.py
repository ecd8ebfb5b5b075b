"""The driver: the controller loop over a runtime's pool and learner, the `steadyrl` CLI, the `ray job submit`
entrypoint (`python -m steadyrl.services.driver.job`), resume, the health watch and `steadyrl eval`.

Imports: the libraries, run_folder/, testbeds/, config, serving/ and runtime/. Nothing imports the driver.
"""
