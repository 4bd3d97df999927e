/* specd version string (also served at GET /version). */
#ifndef SPECD_VERSION_H
#define SPECD_VERSION_H
#define SPECD_VERSION "0.1.0"
#endif
