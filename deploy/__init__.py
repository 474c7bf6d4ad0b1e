"""Start and stop the serving stack (Redis + tritonserver on the rendered model repository)."""
