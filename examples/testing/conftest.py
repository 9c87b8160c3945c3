pytest_plugins = ["celery_ext.testing"]
