#!/usr/bin/env python3
"""The fused kernel's attention item map (fv2_attention_group, fv2_attention_coords, the cache-append range in fv2_attention_item)
mirrored in Python: every (sequence, KV head, split) is run by exactly one item, and each new position is
appended to the cache by exactly one item, for random steps; then the group and item counts at the
bench shapes (256 cached positions, 8 KV heads, 132 CTAs). Usage: experiments/fused/attention_items_coverage.py"""
import random
ATT=32; MAXS=32
def fsplits(keys): return min(MAXS,(keys+ATT-1)//ATT)
def group(splits,nkv,grid):
    best=(1<<31,1<<31,1,0); 
    for g in range(1,max(splits+[1])+1):
        items=sum(nkv*((s+g-1)//g) for s in splits)
        r=(items+grid-1)//grid; c=g*r
        if (c,r)<best[:2]: best=(c,r,g,items)
    return best[2],best[3]
def coords(item,splits,nkv,g):
    acc=0
    for i,s in enumerate(splits):
        groups=(s+g-1)//g; cnt=nkv*groups
        if item<acc+cnt:
            kvh=(item-acc)//groups; sp=(item-acc)%groups*g
            return i,kvh,sp,min(g,s-sp)
        acc+=cnt
    return 0,0,0,0
random.seed(1)
for trial in range(3000):
    nseq=random.randint(1,8); nkv=random.choice([2,8]); grid=random.choice([132,114,78])
    rows=[random.randint(1,16//nseq) for _ in range(nseq)]  # <= 16 rows in all
    pos0=[random.randint(0,5000) for _ in range(nseq)]
    splits=[fsplits(p+r) for p,r in zip(pos0,rows)]
    g,items=group(splits,nkv,grid)
    seen=set(); app=set()
    for it in range(items):
        s,kvh,sp,ns=coords(it,splits,nkv,g)
        assert ns>=1
        keys=pos0[s]+rows[s]; per=(keys+splits[s]-1)//splits[s]
        kb=sp*per; ke=min(keys,(sp+ns)*per)
        for x in range(sp,sp+ns):
            assert (s,kvh,x) not in seen; seen.add((s,kvh,x))
        for r in range(rows[s]):
            kp=pos0[s]+r
            if kb<=kp<ke: assert (s,kvh,kp) not in app; app.add((s,kvh,kp))
    assert seen=={(s,k,x) for s in range(nseq) for k in range(nkv) for x in range(splits[s])}
    assert len(app)==sum(rows)*nkv
print("ok")
for name,nseq,rows,pos in [("1x1",1,1,256),("2x1",2,1,256),("4x1",4,1,256),("8x1",8,1,256),("1x8",1,8,256),("2x8",2,8,256),("8x1 ctx4000",8,1,4000)]:
    splits=[fsplits(pos+rows)]*nseq
    g,items=group(splits,8,132)
    print(name,"splits",splits[0],"g",g,"items",items,"before",8*nseq*splits[0])
