"""The server image: its Containerfile and the script that prepares its build context."""
