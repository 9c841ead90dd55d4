"""Running a job: start local workers or join torchrun / SLURM (:mod:`.launch`), each worker's
life (:mod:`.worker`), and one summary of what failed (:mod:`.diagnostics`).
"""
