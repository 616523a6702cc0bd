"""Running a job: the launcher (one process or many), the workers, process health, the job dir and its result."""
