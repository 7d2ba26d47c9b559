"""What operators and routers use beside the API: the dashboard page and its state endpoint
(``dashboard``, the page in ``static/``), and the worker routes routers drive
(``worker_api``)."""
