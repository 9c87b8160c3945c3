"""The shop site's pages: Django's admin, where the periodic tasks live, and the
sqlinbox dashboard behind the admin's staff login."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path, re_path

from celery_ext.django.dashboard import dashboard_view
from shopsite.celery import app

urlpatterns = [
    path("admin/", admin.site.urls),
    re_path(r"^ops/dashboard(?P<rest>/.*)?$", dashboard_view(app)),
]
