"""What runs in a worker's pool children (spawned; one model instance each): the model runtime,
its handlers by kind, the devices it places them on, and the execution of one batch."""
