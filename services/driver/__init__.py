"""The driver: the controller loop over a runtime's pool and learner, the Python API (`api.py`: `steadyrl.train`,
`load_run`, `Run`), the `steadyrl` CLI over it, the `ray job submit` entrypoint (`python -m
steadyrl.services.driver.job`), resume, the health watch and `steadyrl eval`.

Imports: the libraries, run_folder/, testbeds/, config, serving/ and runtime/. Only the package's front door
(services/api/, which is `steadyrl` itself) imports the driver.
"""
