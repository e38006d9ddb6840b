"""What people read, torch-free: the HTML certificate and its charts, the CI outputs, the
compliance export."""
