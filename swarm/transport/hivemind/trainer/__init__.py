"""The trainer's side of the hivemind transport: driving micro-batches and steps through stage peers."""
