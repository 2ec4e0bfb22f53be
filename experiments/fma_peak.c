#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(){
  __m256 a[12]; __m256 b=_mm256_set1_ps(1.0000001f), c=_mm256_set1_ps(0.999999f);
  for(int i=0;i<12;i++) a[i]=_mm256_set1_ps(i);
  struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0);
  long n=400000000;
  for(long k=0;k<n;k++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++) a[i]=_mm256_fmadd_ps(a[i],b,c);
  }
  clock_gettime(CLOCK_MONOTONIC,&t1);
  double s=(t1.tv_sec-t0.tv_sec)+(t1.tv_nsec-t0.tv_nsec)*1e-9;
  float sum=0; for(int i=0;i<12;i++){float o[8];_mm256_storeu_ps(o,a[i]);sum+=o[0];}
  printf("%.1f GFLOP/s (%f)\n", n*12.0*16/s/1e9, sum);
}
