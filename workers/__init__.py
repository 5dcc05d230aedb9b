"""GPU workers, in rooms by what runs where: batching/ (the main process), child/ (the pool
children: the model), broker/ (the worker's side of Celery, kombu and billiard); main.py is the
entry module that wires them (`celery -A workers.main worker`)."""
