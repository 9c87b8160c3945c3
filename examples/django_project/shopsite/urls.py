"""The shop site's pages: Django's admin, where the periodic tasks live."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
